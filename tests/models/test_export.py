"""torch.export of a freshly built model of every attention type, before any eager forward has run.

The local ops cache their window plans per shape; a plan built while export traces holds traced (fake)
tensors. The test exports first (so nothing is cached from an eager call), then checks the exported
program against eager, and that eager calls afterwards still compute with real tensors.
"""
from __future__ import annotations

import pytest
import timm
import torch

import visattn
from tests.helpers import assert_rms_close

# A 5x7 patch grid used by no other test, so no eager call has cached a plan of this shape before.
IMG_HW, PATCH = (20, 28), 4


@pytest.mark.parametrize("attn", visattn.list_attentions())
def test_export_before_the_first_forward_matches_eager(attn):
    torch.manual_seed(0)
    model = timm.create_model(
        "visattn_vit_tiny_patch16", attn=attn, img_size=IMG_HW, patch_size=PATCH, embed_dim=16, depth=2, num_heads=2,
        num_classes=3, class_token=True,
    ).eval()
    x = torch.randn(2, 3, *IMG_HW)
    exported = torch.export.export(model, (x,))
    with torch.no_grad():
        from_export = exported.module()(x)
        eager = model(x)
        eager_again = model(x)
    assert_rms_close(from_export, eager, 1e-5, f"{attn}: exported vs eager")
    assert torch.equal(eager_again, eager)
    other = torch.randn(2, 3, *IMG_HW)  # the program computes from its input, not from constants of the trace
    with torch.no_grad():
        assert_rms_close(exported.module()(other), model(other), 1e-5, f"{attn}: exported vs eager, new input")
