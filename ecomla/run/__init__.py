"""`ecomla run`: the main job (convert -> distill -> eval -> report) with stages cached by hash."""
