"""Drafters: the direct vocabulary map, the n-gram cache, model and lookup drafters, transformers' assisted
generation (a baseline). Drafters draft; they import no learner."""
