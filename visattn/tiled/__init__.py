"""Tiled inference: a ViT trained at one resolution applied to a larger image by cutting it into overlapping
tiles of the training resolution, running every tile, and merging the tiles' tokens back onto the image's
patch grid. It is the baseline to beat for global attention at high resolution: no token sees beyond its
tile, but every forward is the size the model was trained at.

    from visattn.predict import load_trained_model
    from visattn.tiled import TiledViT

    model = TiledViT(load_trained_model(run_dir), overlap=16)     # tiles of the img_size it was trained at
    logits = model(images)                                        # (B, num_classes) for images larger than that

    timm_vit = timm.create_model("vit_small_patch16_224", pretrained=True).eval()
    token_map = TiledViT(timm_vit, overlap=32, features_only=True)(images)  # (B, 384, H_img / 16, W_img / 16)

How it works, for an image of H x W patches and tiles of h x w patches (:mod:`~visattn.tiled.layout`):

1. **Cut.** Along each axis, tiles start every ``tile - overlap`` pixels; the last one is moved back to end
   at the image edge (so it may overlap its neighbour more). Every tile starts on a patch boundary, so tile
   and overlap must be multiples of the patch size, and so must the image.
2. **Run.** All tiles of all images of the batch go through ``model.forward_features`` as one batch
   (``max_tile_batch`` splits it), giving each tile's prefix tokens and its h x w patch tokens, after the
   model's final norm. A visattn model is told each tile's grid by its patch-grid hook as usual.
3. **Merge** the patch tokens onto the H x W grid, ``merge=``:

   * ``"crop"`` (default): each position takes the token of the one tile where it is most central (along
     rows and along columns; on a tie, the earlier tile). Overlaps are thus split down the middle: every
     token keeps the features of one forward pass, and none comes from the outer half of an overlap, next
     to an inner tile edge, where a token sees least context.
   * ``"blend"``: each position is the mean of the tokens of every tile that covers it, weighted by
     centrality (the product over the two axes of 1 + the distance in tokens to the tile's nearer edge), so
     the tiles fade into each other across the overlap.

   Both are exact where a position is covered once; with one tile the output is the model's own.
4. **Pool and classify** like the wrapped model: the merged tokens are laid out as its ``forward_features``
   lays out its tokens (prefix tokens first), and its own ``forward_head`` pools them (``global_pool``:
   ``avg`` averages the merged grid, each position once; ``map`` attends over it), then applies ``fc_norm``
   and ``head``. Class and register tokens have no place on the grid: each is the mean over the tiles of
   that token. For a class-token model (``global_pool="token"``, whose ``fc_norm`` is the identity), the
   logits are therefore the mean of the tiles' logits.

Functions: :func:`tiled_forward`, :func:`tiled_features` (the merged grid and prefix tokens),
:func:`cut_tiles`, :func:`merge_tiles` and its loop twin :func:`naive_merge_tiles`, :func:`tile_layout`,
:func:`model_tile` (the image size a model was built for: its tile).
"""
from visattn.tiled.functional import (
    TiledFeatures,
    cut_tiles,
    merge_tiles,
    model_tile,
    naive_merge_tiles,
    tiled_features,
    tiled_forward,
)
from visattn.tiled.layout import MERGES, AxisTiles, TileLayout, tile_layout
from visattn.tiled.module import OUTPUT_FORMATS, TiledViT

__all__ = [
    "MERGES",
    "OUTPUT_FORMATS",
    "AxisTiles",
    "TileLayout",
    "TiledFeatures",
    "TiledViT",
    "cut_tiles",
    "merge_tiles",
    "model_tile",
    "naive_merge_tiles",
    "tile_layout",
    "tiled_features",
    "tiled_forward",
]
