"""Block-sparse attention (MiniMax-M3): an indexer scores key blocks per query and KV group, attention runs over
the chosen blocks only."""
