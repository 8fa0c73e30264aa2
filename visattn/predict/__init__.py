"""Using a model trained by ``train.py``: load it from its run directory with the transform and class
names it was trained with, and predict the classes of images (the ``visattn-predict`` command).

    from visattn.predict import load_predictor, predict
    predictor = load_predictor("runs/digits-axial")      # model, transform, class names
    results = predict(predictor, ["a.png", "b.jpg"], top_k=3)
    tiled = predict(load_predictor("runs/digits-axial", dynamic_img_size=True), ["large.png"],
                    tiling=Tiling(tile=16, overlap=8))       # each image at its own size, in tiles

Pieces: :mod:`~visattn.predict.run_dir` (what a run directory holds, :func:`load_trained_model`),
:mod:`~visattn.predict.images` (finding and reading images), :mod:`~visattn.predict.predictor`
(:class:`Predictor`, :func:`predict`), :mod:`~visattn.predict.tiling` (:class:`Tiling`: tiled prediction),
:mod:`~visattn.predict.cli` (the command).
"""
from visattn.predict.images import UnreadableImageError, find_images, read_image, to_rgb
from visattn.predict.predictor import Prediction, Predictor, iter_predictions, load_predictor, predict, resolve_device
from visattn.predict.run_dir import (
    BEST_WEIGHTS, LAST_WEIGHTS, MODEL_FILE, load_trained_model, read_model_file, recorded_data_config,
)
from visattn.predict.tiling import Tiling

__all__ = [
    "BEST_WEIGHTS",
    "LAST_WEIGHTS",
    "MODEL_FILE",
    "Prediction",
    "Predictor",
    "Tiling",
    "UnreadableImageError",
    "find_images",
    "iter_predictions",
    "load_predictor",
    "load_trained_model",
    "predict",
    "read_image",
    "read_model_file",
    "recorded_data_config",
    "resolve_device",
    "to_rgb",
]
