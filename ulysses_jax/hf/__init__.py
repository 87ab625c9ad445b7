"""Hugging Face interoperability: checkpoints in and out, and their configs.

* ``weights``: ``load_llama`` / ``save_llama``, safetensors <-> the FSDP-sharded ``Llama``;
* ``config``: ``config.json`` <-> ``LlamaConfig`` (RoPE scaling included);
* ``moe``: the mixture-of-experts tensors of Qwen3-MoE, Mixtral and gpt-oss;
* ``init_from``: ``TrainConfig.init_from``, a run started from a Hugging Face checkpoint or
  from one of ours;
* ``export``: a checkpoint of ours as a Hugging Face directory (``ulysses-export``).
"""
