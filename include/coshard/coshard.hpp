// The umbrella header: everything a trainer needs (target coshard::coshard).
#pragma once

#include "coshard/async/async.hpp"
#include "coshard/collectives/communicator.hpp"
#include "coshard/collectives/env.hpp"
#include "coshard/collectives/local.hpp"
#include "coshard/collectives/nccl.hpp"
#include "coshard/collectives/store.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/modules/layers.hpp"
#include "coshard/modules/module.hpp"
#include "coshard/modules/optimizer.hpp"
#include "coshard/modules/parameter_store.hpp"
#include "coshard/modules/safetensors.hpp"
#include "coshard/modules/tensor.hpp"
