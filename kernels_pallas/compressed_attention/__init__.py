"""Attention over a sliding window of uncompressed keys plus compressed entries of the whole context, all chosen or
the top-k a lightning indexer picks (DeepSeek-V4's CSA and HCA; its plain sliding layers: no entries)."""
