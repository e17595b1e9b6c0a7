"""The lab: a small real DiT (diffusers' Flux classes), packaged/generated image data, a short
pretraining, and a mini trainer that keeps sd-scripts' Flux trainer method contract, for the demo,
the benchmarks and the map tool. Submodules are imported on use (they pull in diffusers and peft).

- ``model``: ``LabModelConfig``, ``build_model``, ``LabDiT``, ``LabTextEncoder``, ``flop_shape``
- ``data``: ``LabDataConfig``, ``LabData``
- ``pretrain``: ``load_or_pretrain`` (the single-size base, pretrained once and cached)
- ``base``: ``load_base`` (the shipped multi-size base, ``weights/``), ``pretrain_base``
- ``flux_train_utils`` / ``flux_utils``: the host's σ sampler and packing helpers, same contracts
- ``trainer``: ``LabTrainer``, ``train_lora``, ``native_validation_loss``, ``delta_cosine``
- ``generate``: ``sample_latents`` (Euler on the flow) and the spectrum metric of the quality study
"""
