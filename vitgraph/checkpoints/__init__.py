"""Checkpoint files: find, read and refuse them (:mod:`.loading`: vision shards only, safetensors
only, nothing outside the checkpoint opened; :mod:`.fp8`: FP8 vision linears; :mod:`.files`:
the one bounded, regular-file read every layer uses)."""
