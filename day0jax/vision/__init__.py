"""Images for vision-language models: decoding, preprocessing, vision towers."""
