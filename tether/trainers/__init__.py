"""The trainers: one `train_*` function per algorithm family, each reading as its algorithm.

    core/        what every trainer shares: setup_training -> Training (the handles, the resume
                 guard, the rank idioms under torchrun), config sections, data order / optimizer /
                 guarded step, held-out eval points, sharding
    grpo/        the critic-free online RL family (grpo, rloo, remax)
    ppo/         PPO-RLHF with a value model
    preference/  offline DPO family, KTO, SimPO, ORPO; online / iterative DPO
    sft.py, rm.py, prm.py, best_of_n.py   the single-file trainers

Where the sampling trainers' batches come from is the layer below: tether/trajectories.
"""
