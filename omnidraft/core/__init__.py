"""The decode core: the one loop, verification math, KV cache and tree attention, step feedback.

Imports neither hydra, omegaconf nor wandb, and nothing from drafting/, learn/ or above."""
