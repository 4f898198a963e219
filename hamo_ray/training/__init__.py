"""Training: one loop for every objective (BC, ETO's DPO) on long-lived workers, driven stage by stage.

Driver side (the stream's process): ``driver.StageTrainer`` (a stage's trajectories in, an adapter
out), ``trainer`` (``train_model``, ``stage_job``: a ``TrainConfig`` passed whole -> the typed job),
``dpo`` (pairs, ``train_dpo``), ``examples`` (tokenised BC examples), ``group`` (``make_group``,
``KeptGroup``: the engine), the two engines ``ray_train`` (one Ray Train run) and ``actors`` (Ray
actors), ``files`` (adapter files).

Worker side (each training process): ``worker.TrainWorker`` (the loaded model), ``loop.run_stage``
(the loop, top to bottom), ``objectives`` (one loss function per objective, in the registry both
engines use), ``model`` (``load_model``, ``ActionLM``), ``stepper`` (DDP / DeepSpeed, AdamW),
``batches``, ``packing``, ``fused``, ``record`` (per-step figures). ``contracts`` holds what crosses
between the two: frozen dataclasses. Imports point from the driver side to the worker side, never back.
"""
