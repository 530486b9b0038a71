// The umbrella header: everything a trainer needs (target coshard::coshard).
#pragma once

#include "coshard/async/async.hpp"
