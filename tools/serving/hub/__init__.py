"""The Hugging Face hub as the deployment meets it: the token and environment, and fetching a checkpoint."""
