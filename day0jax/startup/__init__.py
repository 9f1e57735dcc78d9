"""Start-up: the persistent compile cache, the program store, parallel warm-up and the start-up timeline."""
