"""``infer.py --weights_dtype fp8``: a checkpoint without FP8 weights is refused with one line (exit 2) before
any parameter is loaded. (Loading and running kept-FP8 weights: tests/convert/test_convert_fp8_keep.py.)"""

from minimax_jax.infer import cli
from minimax_jax.infer.loading import DEFAULT_CHECKPOINT


def test_fp8_with_a_checkpoint_without_fp8_weights_is_a_usage_error(capsys):
    rc = cli.main(["--checkpoint", DEFAULT_CHECKPOINT, "--prompt", "hi", "--weights_dtype", "fp8",
                   "--max_new_tokens", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("infer.py: error: --weights_dtype fp8: checkpoint ") and "holds no FP8 weights" in err[-1]


def test_weights_dtype_flag_parses():
    assert cli.parse(["--weights_dtype", "fp8"]).weights_dtype == "fp8"
    assert cli.parse([]).weights_dtype is None
