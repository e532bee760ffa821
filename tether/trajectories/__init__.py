"""Trajectories: where a trainer's scored batches come from (docs/architecture.md, "Trajectories";
docs/grpo.md, "The trajectory queue").

Below the trainers, above rollout/ and rewards/: a trainer builds a *producer* from its pieces and
hands it to a *source*; neither imports a trainer.

    sampling.py       the producer of one-turn groups: prompts in the data order (PromptStream) ->
                      G completions each (rollout.Sampler) -> rewards (Scoring), DAPO dynamic
                      sampling (collect) -> a StepBatch (GroupSampler)
    episodes.py       the multi-turn episode loop: one engine call runs a batch of environment
                      episodes (tether/envs), the environment's replies fed between the turns
    partial.py        partial rollouts: completions that continue across weight updates, every
                      token tagged with the policy version that sampled it (PartialRollouts)
    queue.py          the bounded trajectory queue between samplers and the trainer, by version
    source.py         the queue's config section (QueueSection) and the base of every source
    asynchronous.py   synchronous and interleaved (a sampler thread) sources; batch_source picks one
    disaggregated.py  sampler processes beside the trainer processes under torchrun

A multi-turn producer (episodes.py's loop over an environment, scored into a StepBatch) is a
callable `produce(step, sampler) -> StepBatch` like GroupSampler, so the sources, the queue, the
checkpointed state and the trainers take it as they take GroupSampler.
"""
