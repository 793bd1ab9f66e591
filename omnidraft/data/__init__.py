"""Tasks, quality metrics, the code sandbox, model loading and artifact fetching."""
