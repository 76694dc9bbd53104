"""benchmarks.gpu_gemm refuses bad arguments and a machine without CUDA by name."""

import pytest

from benchmarks.gpu_gemm import main


def test_bad_token_counts_are_refused(capsys):
    assert main(["--tokens", "0,16"]) == 2
    assert main(["--tokens", "a"]) == 2
    assert "--tokens must be integers >= 1" in capsys.readouterr().err


def test_without_cuda_it_says_so(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here")
    assert main(["--tokens", "16"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
