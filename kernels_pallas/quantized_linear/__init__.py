"""Linear maps whose weights stay quantized: codes with per-group scales (and offsets), multiplied in float32."""
