"""`ecomla build`: the builders of the project's committed data (task files, the tiny world's tokenizer and
corpus, its model zoo, the README's zoo table). Each module's `main(argv)` is one `ecomla build TARGET`."""

BUILDERS = {
    "pytext-tasks": ("ecomla.build.pytext_tasks", "the Python-text lm-eval tasks (eval/tasks/pytext/); --check "
                     "compares a rebuild with the committed files"),
    "tiny-world": ("ecomla.build.tiny_world", "the tiny world's lm-eval tasks (eval/tasks/tinyworld/), tokenizer and "
                   "corpus dumps (.cache/tinyworld/)"),
    "tiny-zoo": ("ecomla.build.tiny_zoo", "the tiny world's model zoo (zoo/): the base and its teachers, pretrained "
                 "with `ecomla pretrain`; --quick for a smoke build"),
    "zoo-table": ("ecomla.build.zoo_table", "the README's tiny-zoo table from saved `ecomla eval` results"),
}
