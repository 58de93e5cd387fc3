"""``python -m earl_lightning.cli``: the ``earl`` command (``torchrun ... -m earl_lightning.cli fit``)."""

from earl_lightning.cli.entry import main

if __name__ == "__main__":
    main()
