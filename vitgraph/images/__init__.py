"""The image path: bytes, arrays and PIL images to uint8 rows (:mod:`.pipeline`): decoding
(:mod:`.decode`, :mod:`.pixel_forms`), PIL preprocessing as transformers' PIL processors
(:mod:`.preprocess`), the same on the device (:mod:`.device`, :mod:`.alpha`), and the
checkpoint's processor files (:mod:`.processor_files`)."""
