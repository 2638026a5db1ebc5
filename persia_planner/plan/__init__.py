"""The plan: plan.json, its validation, what a run must execute, and TorchRec's plans in and out."""
