"""Model parallelism for the GPT in ``runner.model`` over a passed process group: tensor-parallel layers
(``tensor``) and pipeline stages with a 1F1B schedule (``pipeline``). The group is an argument, never a
global, because the runner rebuilds its groups in every generation (see docs/parallelism.md)."""
