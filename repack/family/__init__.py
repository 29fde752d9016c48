"""The Gemma 4 family as the repack knows it: its members and their shapes (members), their speculative-decoding
drafters (drafter), and config.json itself (config: what a valid one holds and what a build writes into it)."""
