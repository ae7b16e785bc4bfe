"""kernels/csrc/simd.h: ``hsum8_x4`` (the scores of four keys reduced together in the CPU
attention kernel) gives ``hsum8``'s bits, the documented fixed tree, for every lane; a check
that can fail: another tree of the same adds differs on about a third of these sums."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from specbatch.kernels.cpu_build import cpu_has_avx2_fma

SIMD_H = Path(__file__).resolve().parents[2] / "kernels" / "csrc" / "simd.h"

CHECK = r"""
#include "SIMD_H"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int main(void) {
    srand(1);
    long same = 0, other_tree_differs = 0, n = 0;
    for (int it = 0; it < 50000; it++) {
        float v[4][8];
        for (int i = 0; i < 4; i++)
            for (int l = 0; l < 8; l++)  /* magnitudes 1 .. 2^19: rounding depends on order */
                v[i][l] = ((float)rand() / (float)RAND_MAX - 0.5f) * (float)(1 << (rand() % 20));
        float got[4];
        _mm_storeu_ps(got, hsum8_x4(_mm256_loadu_ps(v[0]), _mm256_loadu_ps(v[1]),
                                    _mm256_loadu_ps(v[2]), _mm256_loadu_ps(v[3])));
        for (int i = 0; i < 4; i++, n++) {
            const float want = hsum8(_mm256_loadu_ps(v[i]));
            const float *x = v[i];
            const float other = ((x[1] + x[5]) + (x[2] + x[6])) + ((x[0] + x[4]) + (x[3] + x[7]));
            same += memcmp(&want, &got[i], 4) == 0;
            other_tree_differs += memcmp(&want, &other, 4) != 0;
        }
    }
    printf("%ld %ld %ld\n", n, same, other_tree_differs);
    return 0;
}
"""


@pytest.mark.skipif(not cpu_has_avx2_fma(), reason="needs an AVX2 + FMA CPU")
def test_hsum8_x4_gives_hsum8_bits(tmp_path):
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler")
    src = tmp_path / "tree.c"
    src.write_text(CHECK.replace("SIMD_H", str(SIMD_H)))
    exe = tmp_path / "tree"
    subprocess.run([cc, "-O2", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", str(src), "-o", str(exe)],
                   check=True, capture_output=True)
    n, same, other = map(int, subprocess.run([str(exe)], check=True, capture_output=True,
                                             text=True).stdout.split())
    assert n == 200_000
    assert same == n
    assert other > n // 5  # the inputs do tell trees apart
