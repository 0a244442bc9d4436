"""Training a DFlash drafter for a frozen target (dflash.md §3): prompts, target-regenerated responses, cached taps,
the block-diffusion objective and the training loop. Entry point: ``train/cli.py`` (``train-drafter``)."""
