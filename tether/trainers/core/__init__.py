"""What every trainer shares: setup.py (`setup_training` -> `Training`: the one setup, the resume
guard, and the handles and methods every loop uses, with the rank idioms of ranks.py), sections.py
(the config sections), common.py (data order, AdamW and its schedule, the guarded step, the
gradient buffer the sampler's KV cache borrows, checkpoint state, progress), held_out.py (eval
points and keep_best), sharding.py (FSDP2 or replication per model under torchrun)."""
