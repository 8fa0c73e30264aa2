"""Grids of training runs behind the published tables (``results/tables/``): plan them, train or resume them as
``train.py`` processes, read what they left, and write the tables.

    plan.py         rows (attention types with options), seeds, curriculum stages and variants of the data ->
                    train.py's flags per run
    variants.py     named variants of the cluttered digits: the tuning ones and the held-out ones
    execute.py      reuse, resume or train each run in its own train.py process; the time left
    summarize.py    a finished run's summary and per-epoch records, its epochs at chance; a row summed up over
                    its seeds
    stages.py       the first stages of a curriculum table, or runs named by path, each with its second stage
    larger_size.py  a model trained at one size tested at a larger one: upsampled, whole, tiled, best tile
    report.py       the tables as markdown, CSV and JSON; the summary over variants
    plot.py         the accuracy table's figure
    transfer_table.py  the attention-transfer table: each run's stages with the training they took, the parents'
                    and the runs from scratch, summed up over the seeds; markdown, JSON and CSV
    accuracy.py     ``python -m visattn.experiments.accuracy``: train a grid and tabulate it
    resolution.py   ``python -m visattn.experiments.resolution``: test a table's first stages at a larger size
    transfer.py     ``python -m visattn.experiments.transfer``: a softmax parent converted to each type, with and
                    without attention transfer, fine-tuned and tabulated stage by stage
"""
