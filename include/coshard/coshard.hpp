// The umbrella header: everything a trainer needs (target coshard::coshard).
#pragma once

#include "coshard/async/async.hpp"
#include "coshard/collectives/communicator.hpp"
#include "coshard/collectives/env.hpp"
#include "coshard/collectives/local.hpp"
#include "coshard/collectives/nccl.hpp"
#include "coshard/collectives/store.hpp"
#include "coshard/modules/safetensors.hpp"
