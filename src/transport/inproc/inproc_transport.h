// An in-process transport for unit tests of the engine pipeline: endpoints on one fabric
// read each other's registered memory with memcpy and exchange messages through queues.
// It keeps the Transport contract (deadlines, lost peers, bounds checks) so the engine is
// tested against the same behaviour as over UCX; it is never used between processes.
#pragma once

#include <memory>

#include "refit/ext/transport.h"

namespace refit {

class InProcFabric;

std::shared_ptr<InProcFabric> make_inproc_fabric();
std::unique_ptr<Transport> create_inproc_transport(std::shared_ptr<InProcFabric> fabric);

}  // namespace refit
