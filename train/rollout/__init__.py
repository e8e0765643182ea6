"""Rollout generation: the RL's samplers (`Generator`), multi-turn conversations, where the RL
loop's batches come from (`RolloutSource`: sync, or the async worker under its schedule) and the
async generator's run state."""
