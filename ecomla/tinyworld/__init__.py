"""The tiny world: an offline, deterministic corpus, tokenizer and lm-eval suite for CPU experiments.

It lets the whole pipeline (pretrain a small Llama zoo, convert to MLA,
distill, evaluate) run without the hub or a GPU, on text where predicting
the next token needs attention over the context, so compressing the KV cache
has a measurable cost that distillation can win back:

    corpus.iter_documents(domain, split, seed)   endless text: domains "stories" / "records",
                                                 splits "train" / "calibration" / "heldout"
    world.default_world()                        the fixed fact table (cities and their facts)
    tokenizer.train_tokenizer(out_dir)           byte-level BPE + chat template, seconds
    items.mc_items(skill, n)                     multiple-choice eval items; leaked_items() checks them
    taskfiles.write_tasks(out_dir)               lm-eval YAML + JSONL (eval/tasks/tinyworld)

Build everything with `ecomla build tiny-world`.
"""
