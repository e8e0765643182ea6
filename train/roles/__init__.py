"""The models on their meshes and the owners of their state: `ModelRole`, `RoleCluster`,
`SamplerWeights` (the sampler's copy of the actor), `Learner`, idle-role offload."""
