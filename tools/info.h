// `refit info`: what refit finds on this machine, in the spirit of `ucx_info`.
#pragma once

namespace refit::tools {
int run_info();
}
