"""Observers that learn from step feedback: losses, the online learner, LoRA, the acceptance head,
draft-length policies, DistillSpec's data."""
