// mesh.c: the device mesh of mesh.h. Everything follows from the rank formula
//   r = (((pp_i * DR + dr_i) * DS + ds_i) * CP + cp_i) * TP + tp_i
// and every group is a comm_split whose color is "this rank with the group's coordinates zeroed".
#include "mesh.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "fileio.h"
#include "log.h"

static const char *const dim_names[MESH_N_DIMS] = {"pp", "dp_replicate", "dp_shard", "cp", "tp"};
static const char *const dim_flags[MESH_N_DIMS] = {"--pp", "--dp-replicate", "--dp-shard", "--cp", "--tp"};

const char *mesh_dim_name(MeshDim d) {
    if ((int)d < 0 || d >= MESH_N_DIMS) fatal("mesh_dim_name: no dimension %d", (int)d);
    return dim_names[d];
}

int mesh_rank_of(const Mesh *m, const int coord[MESH_N_DIMS]) {
    int r = 0;
    for (int d = 0; d < MESH_N_DIMS; d++) {
        if (coord[d] < 0 || coord[d] >= m->degree[d])
            fatal("mesh_rank_of: %s coordinate %d is not in [0, %d)", dim_names[d], coord[d], m->degree[d]);
        r = r * m->degree[d] + coord[d];
    }
    return r;
}

static void coords_of(const int degree[MESH_N_DIMS], int rank, int coord[MESH_N_DIMS]) {
    for (int d = MESH_N_DIMS - 1; d >= 0; d--) {
        coord[d] = rank % degree[d];
        rank /= degree[d];
    }
}

// The flat data-parallel index: dp_replicate outer, dp_shard inner (the order of the mesh).
static int dp_index(const int degree[MESH_N_DIMS], const int coord[MESH_N_DIMS]) {
    return coord[MESH_DP_REPLICATE] * degree[MESH_DP_SHARD] + coord[MESH_DP_SHARD];
}

// Why these degrees cannot make a mesh of `world` ranks, in one line; "" when they can.
static void find_mesh_problem(const int degree[MESH_N_DIMS], int world, char *why, size_t len) {
    *why = 0;
    long long product = 1;
    char factors[160] = "";
    size_t used = 0;
    for (int d = 0; d < MESH_N_DIMS; d++) {
        if (degree[d] < 1) {
            snprintf(why, len, "%s %d: must be at least 1", dim_flags[d], degree[d]);
            return;
        }
        if (product <= INT_MAX) product *= degree[d];  // stops growing once it is surely wrong
        if (degree[d] != 1 && used < sizeof factors)
            used += (size_t)snprintf(factors + used, sizeof factors - used, "%s%s %d", used ? " x " : "",
                                     dim_flags[d], degree[d]);
    }
    if (product != world)
        snprintf(why, len, "%s = %lld rank%s, but mpirun started %d (the product of --pp --dp-replicate --dp-shard "
                 "--cp --tp must be the number of ranks)",
                 used ? factors : "every mesh degree is 1", product, product == 1 ? "" : "s", world);
}

// Every rank finds the same problem; world rank 0 alone prints it and exits with status 2. The
// others wait in a barrier that cannot finish, so that mpirun, seeing rank 0 exit, ends them after
// the line is out (and exits with status 2) instead of racing it with their own exits.
__attribute__((noreturn)) static void exit_bad_mesh(const char *why) {
    Comm *world = comm_world();
    if (comm_rank(world) == 0) fatal_input("%s", why);
    comm_barrier(world);
    exit(EXIT_BAD_INPUT);
}

// The group of ranks that differ from this one only in the dimensions of `dims` (a bit per
// MeshDim). The color is this rank with those coordinates zeroed, the same for the whole group;
// the key is the flat index of the group's own coordinates, so group ranks follow mesh order.
static Comm *split_over(const Mesh *m, unsigned dims, const char *name) {
    int base[MESH_N_DIMS], key = 0;
    for (int d = 0; d < MESH_N_DIMS; d++) {
        bool in_group = dims & (1u << d);
        base[d] = in_group ? 0 : m->coord[d];
        if (in_group) key = key * m->degree[d] + m->coord[d];
    }
    return comm_split(m->world, mesh_rank_of(m, base), key, name);
}

Mesh *mesh_create(int pp, int dp_replicate, int dp_shard, int cp, int tp) {
    int degree[MESH_N_DIMS] = {pp, dp_replicate, dp_shard, cp, tp};
    Comm *world = comm_world();
    char why[320];
    find_mesh_problem(degree, comm_size(world), why, sizeof why);
    if (*why) exit_bad_mesh(why);

    Mesh *m = calloc(1, sizeof *m);
    if (!m) fatal("mesh_create: out of memory");
    memcpy(m->degree, degree, sizeof degree);
    m->world = world;
    m->rank = comm_rank(world);
    m->world_size = comm_size(world);
    coords_of(m->degree, m->rank, m->coord);
    for (int d = 0; d < MESH_N_DIMS; d++) m->dim[d] = split_over(m, 1u << d, dim_names[d]);
    m->dp_shard_cp = split_over(m, 1u << MESH_DP_SHARD | 1u << MESH_CP, "dp_shard_cp");
    m->dp = split_over(m, 1u << MESH_DP_REPLICATE | 1u << MESH_DP_SHARD, "dp");
    m->dp_cp = cp > 1 ? split_over(m, 1u << MESH_DP_REPLICATE | 1u << MESH_DP_SHARD | 1u << MESH_CP, "dp_cp") : m->dp;
    snprintf(m->label, sizeof m->label, "rank %d [pp%d dp%d cp%d tp%d]", m->rank, m->coord[MESH_PP],
             dp_index(m->degree, m->coord), m->coord[MESH_CP], m->coord[MESH_TP]);
    return m;
}

void mesh_free(Mesh *m) {
    if (!m) return;
    for (int d = 0; d < MESH_N_DIMS; d++) comm_free(m->dim[d]);
    comm_free(m->dp_shard_cp);
    if (m->dp_cp != m->dp) comm_free(m->dp_cp);
    comm_free(m->dp);
    free(m);
}

// ---- Graphviz -------------------------------------------------------------------------------------

static void dot_node(FILE *fp, const Mesh *m, int r) {
    int c[MESH_N_DIMS];
    coords_of(m->degree, r, c);
    fprintf(fp, "      r%d [label=\"rank %d\\npp%d dr%d ds%d cp%d tp%d\"];\n", r, r, c[MESH_PP], c[MESH_DP_REPLICATE],
            c[MESH_DP_SHARD], c[MESH_CP], c[MESH_TP]);
}

// A chain through each group of dimension d (rank -> the rank one step further along d).
static void dot_group_edges(FILE *fp, const Mesh *m, MeshDim d, const char *color) {
    for (int r = 0; r < m->world_size; r++) {
        int c[MESH_N_DIMS];
        coords_of(m->degree, r, c);
        if (c[d] + 1 >= m->degree[d]) continue;
        c[d]++;
        fprintf(fp, "  r%d -- r%d [color=%s, fontcolor=%s, label=\"%s\"];\n", r, mesh_rank_of(m, c), color, color,
                dim_names[d]);
    }
}

static void write_dot(FILE *fp, const Mesh *m) {
    const int *g = m->degree;
    int dp = g[MESH_DP_REPLICATE] * g[MESH_DP_SHARD], per_replica = g[MESH_CP] * g[MESH_TP];
    fprintf(fp, "graph mesh {\n  label=\"mesh pp%d x dp_replicate%d x dp_shard%d x cp%d x tp%d = %d ranks\";\n"
                "  labelloc=t;\n  node [shape=box, fontname=\"Helvetica\"];\n",
            g[MESH_PP], g[MESH_DP_REPLICATE], g[MESH_DP_SHARD], g[MESH_CP], g[MESH_TP], m->world_size);
    // Ranks are numbered pp-major, then dp, then cp x tp: each cluster is a run of consecutive ranks.
    for (int p = 0; p < g[MESH_PP]; p++) {
        fprintf(fp, "  subgraph cluster_pp%d {\n    label=\"pp stage %d\";\n", p, p);
        for (int d = 0; d < dp; d++) {
            fprintf(fp, "    subgraph cluster_pp%d_dp%d {\n      label=\"dp %d (replicate %d, shard %d)\";\n", p, d, d,
                    d / g[MESH_DP_SHARD], d % g[MESH_DP_SHARD]);
            int first = (p * dp + d) * per_replica;
            for (int r = first; r < first + per_replica; r++) dot_node(fp, m, r);
            fprintf(fp, "    }\n");
        }
        fprintf(fp, "  }\n");
    }
    dot_group_edges(fp, m, MESH_TP, "blue");
    dot_group_edges(fp, m, MESH_CP, "red");
    fprintf(fp, "}\n");
}

void mesh_write_dot(const Mesh *m, const char *path) {
    char err[512];
    AtomicFile f;
    if (!atomic_create(&f, path, err, sizeof err)) fatal("mesh_write_dot: %s", err);
    write_dot(f.fp, m);
    if (!atomic_commit(&f, err, sizeof err)) fatal("mesh_write_dot: %s", err);
}
