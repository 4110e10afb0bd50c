"""Producer side: ingest prompts, build and submit jobs. Needs no JAX."""
