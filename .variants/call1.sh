export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log --oneline -1
M="python3 bench/memory_check.py --device cuda --algo grpo --shape qwen2.5-0.5b --prompts 8 --generations 8 --prompt-len 128 --new-tokens 256 --gradient-checkpointing --dtype bf16 --compile --steps 3 --peak 400000"
timeout 150 python3 bench/grpo_profile.py --device cuda --micro-batch 16 --compile --json $OUT/profile.json 2>&1 | grep -v Warning | tail -25
timeout 100 $M --micro-batch 16 --out $OUT/mem16.jsonl 2>&1 | tail -45
timeout 100 $M --micro-batch 32 --offload-activations --out $OUT/mem32h.jsonl 2>&1 | tail -45
timeout 90 python3 bench/grpo_step.py --device cuda --ours-micro-batches 16c --skip-trl 2>&1 | tail -6
timeout 120 python3 bench/grpo_step.py --device cuda --ours-micro-batches 16c --skip-trl --inductor cpp_wrapper=True 2>&1 | tail -6
