"""Training: the config (plain data, config.py), the run it resolves to (plan.py), the checks
before any compute (preflight.py), distributed wrapping (parallel.py), monitoring and the loop
(trainer.py).

Nothing is imported here, so `import meshlm.train.config` loads neither torch nor the model; import
the module you need (`from meshlm.train.trainer import train`)."""
