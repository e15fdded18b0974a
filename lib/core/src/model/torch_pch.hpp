// Precompiled header of the tensor code. The ATen/types subset, not <torch/torch.h>: the full
// header (nn, optim, data) doubles the parse time and the PCH size of every file.
#pragma once
#include <ATen/ATen.h>
#include <torch/types.h>
#include <torch/utils.h>
