// Everything in coshard::async.
#pragma once

#include "coshard/async/channel.hpp"
#include "coshard/async/device.hpp"
#include "coshard/async/event.hpp"
#include "coshard/async/files.hpp"
#include "coshard/async/join_handle.hpp"
#include "coshard/async/memory.hpp"
#include "coshard/async/net.hpp"
#include "coshard/async/result.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/async/semaphore.hpp"
#include "coshard/async/stream.hpp"
#include "coshard/async/sync.hpp"
#include "coshard/async/task.hpp"
#include "coshard/async/time.hpp"
#include "coshard/async/when_all.hpp"
