"""Mamba2's selective state-space scan (SSD): chunked for prefill, recurrent for decode (NemotronH, Falcon-H1,
Granite 4)."""
