"""The run folder's records (STATE_DIR): a server's state file, the router's, and where each named instance lives.
Every process record is read and checked here, the same way for every kind."""
