// mesh.h: the device mesh. world = pp x dp_replicate x dp_shard x cp x tp, outermost first
// (docs/ARCHITECTURE.md), so tensor-parallel ranks are adjacent: world rank
//   r = (((pp_i * DR + dr_i) * DS + ds_i) * CP + cp_i) * TP + tp_i.
// Every dimension has a communicator over the ranks that differ only in that coordinate, plus the
// combined groups later chapters reduce over.
#pragma once
#include <stdio.h>

#include "common/comm.h"

typedef enum { MESH_PP, MESH_DP_REPLICATE, MESH_DP_SHARD, MESH_CP, MESH_TP, MESH_N_DIMS } MeshDim;

typedef struct {
    int degree[MESH_N_DIMS];
    int coord[MESH_N_DIMS];
    int rank, world_size;
    Comm *world;
    Comm *dim[MESH_N_DIMS];  // named "pp", "dp_replicate", "dp_shard", "cp", "tp"
    Comm *dp_shard_cp;       // FSDP reduces gradients over dp_shard x cp
    Comm *dp;                // dp_replicate x dp_shard: the data-parallel ranks (DDP, HSDP)
    Comm *dp_cp;             // dp x cp: the ranks whose gradients are averaged (dp itself when cp = 1)
    char label[96];          // "rank 5 [pp0 dp1 cp0 tp1]" (dp = the flat data-parallel index)
} Mesh;

// Collective over comm_world(). Exits with status 2 and one line if the product of the degrees
// differs from the world size ("--dp-shard 3 x --tp 2 = 6 ranks, but mpirun started 4"), or if a
// degree is < 1.
Mesh *mesh_create(int pp, int dp_replicate, int dp_shard, int cp, int tp);
void mesh_free(Mesh *m);
const char *mesh_dim_name(MeshDim d);
// World rank of the rank at these coordinates.
int mesh_rank_of(const Mesh *m, const int coord[MESH_N_DIMS]);
// Graphviz: one node per rank labelled with its coordinates, nested clusters per pp stage and
// data-parallel replica, edges joining the members of each tp and cp group. Any rank may call it.
void mesh_write_dot(const Mesh *m, const char *path);
