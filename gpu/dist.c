// dist.c: device collectives through comm.h (dist.h). The staging through host memory that lived
// here is the staged device backend now (comm_staged.c), so there is one implementation of it.
#include "gpu/dist.h"

#include "common/log.h"
#include "gpu/comm_device.h"

// Without a device backend comm.c would take the device pointer for host memory.
static void require_backend(const char *what) {
    if (!comm_device_backend()) fatal("%s on device memory: no device backend (call gpu_comm_backend_init)", what);
}

void gpu_model_broadcast(Comm *c, GpuModel *m, int root) {
    require_backend("gpu_model_broadcast");
    comm_broadcast(c, m->params, m->table.total_numel, COMM_FLOAT32, root);
    gpu_model_refresh_compute_copy(m);  // queued after the broadcast's wait: it reads the new weights
}
