"""Trajectories: where a trainer's scored batches come from (docs/architecture.md, "Trajectories";
docs/grpo.md, "The trajectory queue").

Below the trainers, above rollout/ and rewards/: a trainer builds a *producer* from its pieces and
hands it to a *source*; neither imports a trainer.

    sampling.py       the producer of groups: prompts in the data order (PromptStream) ->
                      G completions each (rollout.Sampler), or with env= G episodes each of an
                      environment (tether/envs/rollouts.py: one engine call for the batch) ->
                      rewards (Scoring), DAPO dynamic sampling (collect) -> a StepBatch (GroupSampler)
    episodes.py       what training takes of an episode: held-out episodes at eval points
                      (EpisodeEval), its transcript and trained / masked segments in samples
    partial.py        partial rollouts: completions that continue across weight updates, every
                      token tagged with the policy version that sampled it (PartialRollouts)
    queue.py          the bounded trajectory queue between samplers and the trainer, by version
    source.py         the queue's config section (QueueSection) and the base of every source
    asynchronous.py   synchronous and interleaved (a sampler thread) sources; batch_source picks one
    disaggregated.py  sampler processes beside the trainer processes under torchrun

Episodes come out of GroupSampler as the same StepBatch (its rollout with `observation_mask` and
the episodes' records), so the sources, the queue, the checkpointed state and the trainers take
them unchanged.
"""
