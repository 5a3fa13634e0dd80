"""Real text that every Python installation carries: the language reference's prose and the stdlib's code.

  corpus  the documents of the two domains, split into calibration / train / heldout by a hash of their names
  tasks   lm-eval task files built from the held-out split (perplexity and multiple choice)

Used through the dataset names `pytext:SPLIT[:DOMAIN]` (see `ecomla.data.text`).
"""
