"""Distillation of a converted MLA student from its source teacher: losses and the training loop."""
