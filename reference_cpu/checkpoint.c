#include "reference_cpu/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>

#include "common/fileio.h"
#include "common/log.h"
#include "common/safetensors.h"

#define CHECKPOINT_FORMAT "llama-ref-checkpoint-v1"
#ifdef REF_FLOAT64
#define ST_REAL ST_F64
#else
#define ST_REAL ST_F32
#endif

static const char *const STATE_PREFIXES[3] = {"param.", "adam_m.", "adam_v."};

static void add_metadata(StWriter *w, const char *key, const char *value) {
    char err[512];
    if (!st_writer_add_metadata(w, key, value, err, sizeof err)) fatal("checkpoint: %s", err);
}

void checkpoint_path_for_step(const char *dir, long long step, char *out, size_t out_len) {
    snprintf(out, out_len, "%s/step_%06lld.safetensors", dir, step);
}

// A state that is not finite everywhere is never written: resuming from it could only continue
// the divergence, and it would replace the last good checkpoint as the latest. Weights can stay
// finite while AdamW's v overflows (a gradient element above 1.8e19 squares to inf in float32, its
// update is then 0), so all three are scanned. Exits with status 1 naming the first bad element.
static void refuse_non_finite(const Model *m, const real *const buffers[3], long long step, const char *path) {
    for (int b = 0; b < 3; b++)
        for (int i = 0; i < m->table.count; i++) {
            const ParamInfo *p = &m->table.items[i];
            const real *x = buffers[b] + p->offset;
            for (size_t j = 0; j < p->numel; j++)
                if (!isfinite(x[j]))
                    fatal("step %lld: %s%s[%zu] is %g; %s is not written, the last checkpoint written stays the "
                          "latest (try a lower --lr or a --grad-clip)", step, STATE_PREFIXES[b], p->name, j,
                          (double)x[j], path);
        }
}

void checkpoint_save(const char *path, const Model *m, const real *adam_m, const real *adam_v, long long step,
                     const RunIdentity *run) {
    const real *buffers[3] = {m->params, adam_m, adam_v};
    refuse_non_finite(m, buffers, step, path);
    char err[1024], name[PARAM_NAME_MAX + 16], text[64];
    StWriter *w = st_writer_new();
    for (int b = 0; b < 3; b++)
        for (int i = 0; i < m->table.count; i++) {
            const ParamInfo *p = &m->table.items[i];
            int64_t shape[2] = {p->shape[0], p->shape[1]};
            snprintf(name, sizeof name, "%s%s", STATE_PREFIXES[b], p->name);
            if (!st_writer_add(w, name, ST_REAL, p->ndim, shape, buffers[b] + p->offset, err, sizeof err))
                fatal("checkpoint: %s", err);
        }
    char *config = model_config_to_json(&m->cfg);
    add_metadata(w, "format", CHECKPOINT_FORMAT);
    add_metadata(w, "dtype", REAL_NAME);
    add_metadata(w, "config", config);
    free(config);
#define ADD_NUMBER(key, fmt, value)               \
    snprintf(text, sizeof text, fmt, value);      \
    add_metadata(w, key, text);
    ADD_NUMBER("step", "%lld", step);
    ADD_NUMBER("seed", "%" PRIu64, run->seed);
    ADD_NUMBER("batch", "%d", run->batch);
    ADD_NUMBER("seq_len", "%d", run->seq_len);
    ADD_NUMBER("total_steps", "%lld", run->total_steps);
    ADD_NUMBER("lr", "%.17g", run->lr);
#undef ADD_NUMBER
    add_metadata(w, "data", run->data_spec);
    if (run->data_identity) add_metadata(w, "data_identity", run->data_identity);
    if (run->schedule) add_metadata(w, "schedule", run->schedule);
    if (run->settings) add_metadata(w, "settings", run->settings);
    // checked on load: a file damaged since is refused
    if (!st_writer_add_data_hash(w, err, sizeof err) || !st_write(w, path, err, sizeof err))
        fatal("checkpoint: %s", err);
    st_writer_free(w);
}

static const char *require_metadata(const StFile *f, const char *key) {
    const char *value = st_metadata(f, key);
    if (!value) fatal_input("%s: not a checkpoint of this trainer (metadata \"%s\" missing)", st_path(f), key);
    return value;
}

// Fails unless the checkpoint's value for key equals ours.
static void expect_same(const StFile *f, const char *key, const char *ours, const char *flag) {
    const char *theirs = require_metadata(f, key);
    if (strcmp(theirs, ours) != 0)
        fatal_input("%s: written with %s %s, this run has %s (resume needs the same run settings)", st_path(f),
                    flag, theirs, ours);
}

// The completed step: a decimal integer in 0..total_steps (a larger one would index data the run
// never reaches, and one beyond long long would wrap).
static long long parse_step(const StFile *f, long long total_steps) {
    const char *text = require_metadata(f, "step");
    char *end = NULL;
    errno = 0;
    long long step = strtoll(text, &end, 10);
    if (end == text || *end || errno == ERANGE || step < 0 || step > total_steps)
        fatal_input("%s: bad step \"%.40s\" (must be an integer in 0..%lld, the run's total steps)", st_path(f), text,
                    total_steps);
    return step;
}

// The learning rate, schedule and the other update settings may change on resume; say so when they
// do. Checkpoints written before these keys existed carry none, and load silently.
static void note_schedule_change(const StFile *f, const RunIdentity *run) {
    const char *lr = st_metadata(f, "lr"), *schedule = st_metadata(f, "schedule");
    if (lr) {  // the writer's %.17g of --lr, finite and 0 or more: anything else is a damaged file
        char *end = NULL;
        double theirs = strtod(lr, &end);
        if (end == lr || *end || !isfinite(theirs) || theirs < 0)
            fatal_input("%s: bad lr \"%.40s\" (must be a finite number, 0 or more)", st_path(f), lr);
        if (theirs != run->lr) log_info("resume: --lr changes from %g (checkpoint) to %g", theirs, run->lr);
    }
    if (schedule && run->schedule && strcmp(schedule, run->schedule) != 0)
        log_info("resume: the schedule changes from \"%s\" (checkpoint) to \"%s\"", schedule, run->schedule);
    const char *settings = st_metadata(f, "settings");
    if (settings && run->settings && strcmp(settings, run->settings) != 0)
        log_info("resume: the settings change from \"%s\" (checkpoint) to \"%s\"", settings, run->settings);
}

// The checks of checkpoint_load that need only the header: format, dtype, the model's shape, the
// run's identity and the step. Returns the step.
static long long check_header(const StFile *f, const ModelConfig *ours, const RunIdentity *run) {
    const char *path = st_path(f);
    char err[1024], text[64];
    if (strcmp(require_metadata(f, "format"), CHECKPOINT_FORMAT) != 0)
        fatal_input("%s: unknown checkpoint format \"%s\"", path, st_metadata(f, "format"));
    expect_same(f, "dtype", REAL_NAME, "dtype");
    ModelConfig theirs;
    if (!model_config_from_json(require_metadata(f, "config"), &theirs, err, sizeof err))
        fatal_input("%s: %s", path, err);
    char diff[160];
    if (!model_config_same_shape(ours, &theirs, diff, sizeof diff)) {
        // A model read from a Hugging Face config is named "hf": the usual mistake is the flag left out
        // (or added) on resume, which the first differing field would not say.
        bool hf_theirs = strcmp(theirs.name, "hf") == 0, hf_ours = strcmp(ours->name, "hf") == 0;
        const char *hint = hf_theirs && !hf_ours ? "; that run started from --init-from hf:DIR: give it again"
                           : !hf_theirs && hf_ours ? "; that run did not start from --init-from: give its --model"
                                                   : "";
        fatal_input("%s: written for model %s, which has a different shape from this run's --model %s (first "
                    "difference, this run vs the checkpoint: %s)%s", path, theirs.name, ours->name, diff, hint);
    }
#define EXPECT_NUMBER(key, fmt, value, flag)   \
    snprintf(text, sizeof text, fmt, value);   \
    expect_same(f, key, text, flag);
    EXPECT_NUMBER("seed", "%" PRIu64, run->seed, "--seed");
    EXPECT_NUMBER("batch", "%d", run->batch, "--batch");
    EXPECT_NUMBER("seq_len", "%d", run->seq_len, "--seq-len");
    EXPECT_NUMBER("total_steps", "%lld", run->total_steps, "--steps");
#undef EXPECT_NUMBER
    const char *their_data = st_metadata(f, "data_identity");
    if (their_data && run->data_identity && strcmp(their_data, run->data_identity) != 0)
        fatal_input("%s: written with --data %s (%s), this run's --data %s is other data (%s)", st_path(f),
                    require_metadata(f, "data"), their_data, run->data_spec, run->data_identity);
    if (!their_data) expect_same(f, "data", run->data_spec, "--data");  // a checkpoint from before identities
    return parse_step(f, run->total_steps);
}

long long checkpoint_check(const char *path, const ModelConfig *cfg, const RunIdentity *run) {
    char err[1024];
    StFile *f = st_open_header(path, err, sizeof err);
    if (!f) fatal_input("--resume: %s", err);
    long long step = check_header(f, cfg, run);
    // The data too (read from disk a chunk at a time): a damaged checkpoint stops the run here,
    // before it writes anything, not at the load, after its diagrams are written.
    if (!st_check_data_hash(f, err, sizeof err)) fatal_input("--resume: %s", err);
    st_close(f);
    return step;
}

// What checkpoint_save never writes (non-finite values, a negative second moment) is a file damaged,
// or made by something else: refused here, naming the element, rather than trained on until the
// loss turns NaN and the message blames the learning rate. Files written before the hashes existed
// have nothing else that would catch it.
static void refuse_impossible_state(const Model *m, real *const buffers[3], const char *path) {
    for (int b = 0; b < 3; b++)
        for (int i = 0; i < m->table.count; i++) {
            const ParamInfo *p = &m->table.items[i];
            const real *x = buffers[b] + p->offset;
            for (size_t j = 0; j < p->numel; j++)
                if (!isfinite(x[j]) || (buffers[b] == buffers[2] && x[j] < 0))
                    fatal_input("--resume: %s: %s%s[%zu] is %g, which no checkpoint of this trainer holds (a %s)",
                                path, STATE_PREFIXES[b], p->name, j, (double)x[j],
                                isfinite(x[j]) ? "second moment below 0" : "non-finite value");
        }
}

long long checkpoint_load(const char *path, Model *m, real *adam_m, real *adam_v, const RunIdentity *run) {
    char err[1024];
    StFile *f = st_open(path, err, sizeof err);
    if (!f) fatal_input("--resume: %s", err);
    long long step = check_header(f, &m->cfg, run);
    if (!st_check_data_hash(f, err, sizeof err)) fatal_input("--resume: %s", err);  // none in older checkpoints
    note_schedule_change(f, run);
    real *buffers[3] = {m->params, adam_m, adam_v};
    char name[PARAM_NAME_MAX + 16];
    for (int b = 0; b < 3; b++)
        for (int i = 0; i < m->table.count; i++) {
            const ParamInfo *p = &m->table.items[i];
            int64_t shape[2] = {p->shape[0], p->shape[1]};
            snprintf(name, sizeof name, "%s%s", STATE_PREFIXES[b], p->name);
            if (!st_read(f, name, ST_REAL, p->ndim, shape, buffers[b] + p->offset, err, sizeof err))
                fatal_input("--resume: %s", err);
        }
    refuse_impossible_state(m, buffers, path);
    st_close(f);
    return step;
}

// Whether name is a checkpoint temporary, "step_N.safetensors.tmp.<pid>" (or its FP8 companion's,
// "step_N.safetensors.fp8.tmp.<pid>"), whose writer has gone:
// kill(pid, 0) fails with ESRCH. Other files in the directory are never touched.
static bool writer_gone(const char *name) {
    const char *tmp = strstr(name, ".safetensors.tmp."), *fp8_tmp = strstr(name, ".safetensors.fp8.tmp.");
    if (strncmp(name, "step_", 5) != 0 || (!tmp && !fp8_tmp)) return false;
    const char *digits = tmp ? tmp + strlen(".safetensors.tmp.") : fp8_tmp + strlen(".safetensors.fp8.tmp.");
    char *end = NULL;
    long pid = strtol(digits, &end, 10);
    if (end == digits || *end || pid <= 0) return false;
    return kill((pid_t)pid, 0) != 0 && errno == ESRCH;
}

void checkpoint_clean_stale(const char *dir_path) {
    DIR *dir = opendir(dir_path);
    if (!dir) return;  // a missing directory has nothing stale; the writes will report real errors
    char path[4096];
    for (struct dirent *e; (e = readdir(dir));) {
        if (!writer_gone(e->d_name)) continue;
        snprintf(path, sizeof path, "%s/%s", dir_path, e->d_name);
        if (remove(path) == 0) log_info("removed %s, left by a writer that is gone", path);
    }
    closedir(dir);
}

long long checkpoint_step_of_name(const char *name) {
    long long step;
    int consumed = 0;
    if (sscanf(name, "step_%lld.safetensors%n", &step, &consumed) != 1 || name[consumed] != 0 || step < 0) return -1;
    // Only the names the writer makes: step_10, step_+7 or an overflowing number would otherwise
    // pick a step whose canonical file (step_000010) is not there.
    char canonical[64];
    snprintf(canonical, sizeof canonical, "step_%06lld.safetensors", step);
    return strcmp(canonical, name) == 0 ? step : -1;
}

// The lock's descriptor stays open for the life of the process: the kernel drops the lock when the
// process ends, however it ends, so a killed run never leaves the directory locked.
static int claimed_lock_fd = -1;

// DIR/.lock, opened for the lock: never through a symbolic link (the pid written into it would
// replace whatever the link points at, the training text included), never anything but a regular
// file (a FIFO would block the open: O_NONBLOCK).
static int open_lock_file(const char *dir_path, const char *lock_path) {
    int fd = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
    if (fd < 0 && errno == ELOOP)
        fatal_input("--checkpoint-dir %s: %s is a symbolic link; the run writes its process id there and never "
                    "through a link (remove it)", dir_path, lock_path);
    if (fd < 0) fatal_input("--checkpoint-dir %s: cannot open %s (%s)", dir_path, lock_path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        fatal_input("--checkpoint-dir %s: %s is not a regular file; the run would write its process id into it "
                    "(remove it)", dir_path, lock_path);
    return fd;
}

// The step of a companion's name (step_000012.safetensors.fp8: delayed FP8's history), or -1.
static long long companion_step_of_name(const char *name) {
    size_t n = strlen(name);
    if (n < 5 || strcmp(name + n - 4, ".fp8") != 0 || n - 4 >= 300) return -1;
    char checkpoint[300];
    snprintf(checkpoint, sizeof checkpoint, "%.*s", (int)(n - 4), name);
    return checkpoint_step_of_name(checkpoint);
}

// A directory is one run's: another run's checkpoints (or companions) there are refused unless this
// run resumes from it, and then any later than the step it resumes from.
static void refuse_other_runs_files(const char *dir_path, const char *resume_path, long long resumed_step) {
    // Another run's checkpoints would be overwritten step by step, and a later --resume of this
    // directory could continue from them: only the run resumed from this directory may write here.
    DIR *dir = opendir(dir_path);
    if (!dir) fatal_input("--checkpoint-dir %s: cannot read it (%s)", dir_path, strerror(errno));
    char found[300] = "", latest[300] = "";
    long long latest_step = -1;
    for (struct dirent *e; (e = readdir(dir));) {
        long long step = checkpoint_step_of_name(e->d_name);
        if (step < 0) step = companion_step_of_name(e->d_name);  // a companion alone is a run's file too
        if (step < 0) continue;
        if (!*found) snprintf(found, sizeof found, "%s", e->d_name);
        if (step > latest_step) latest_step = step, snprintf(latest, sizeof latest, "%s", e->d_name);
    }
    closedir(dir);
    bool resumed_here = false;
    if (resume_path) {
        char parent[4096];
        snprintf(parent, sizeof parent, "%s", resume_path);
        char *slash = strrchr(parent, '/');
        if (slash) *slash = 0;
        else snprintf(parent, sizeof parent, ".");
        resumed_here = fileio_same_file(parent, dir_path);
    }
    if (*found && !resumed_here)
        fatal_input("--checkpoint-dir %s: holds another run's checkpoints (%s); --resume %s to continue that run, "
                    "or give an empty directory", dir_path, found, dir_path);
    // Resumed from an earlier checkpoint of this directory (by its recorded step: a renamed copy
    // counts as what it is): the run would replace the later ones with another continuation (and a
    // later --resume DIR would take a mix of the two).
    const char *resumed_name = resume_path ? strrchr(resume_path, '/') : NULL;
    resumed_name = resumed_name ? resumed_name + 1 : resume_path;
    if (resumed_here && latest_step > resumed_step)
        fatal_input("--checkpoint-dir %s: holds %s, later than the %s resumed from, which this run would replace; "
                    "--resume %s continues from the latest, or give another directory (or remove the later ones)",
                    dir_path, latest, resumed_name, dir_path);
}

// Another live run holding fd's lock: refused, naming it (the pid it wrote).
static void refuse_if_locked(int fd, const char *dir_path, const char *lock_path) {
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) return;
    char holder[32] = "";
    ssize_t n = pread(fd, holder, sizeof holder - 1, 0);
    holder[n > 0 ? n : 0] = 0;
    holder[strcspn(holder, "\n")] = 0;
    fatal_input("--checkpoint-dir %s: in use by another run (process %s holds %s); give each run its own directory",
                dir_path, *holder ? holder : "?", lock_path);
}

void checkpoint_dir_check(const char *dir_path, const char *resume_path, long long resumed_step) {
    struct stat st;
    if (stat(dir_path, &st) != 0) return;  // a new directory: nothing there yet (fileio_check_output made sure of the rest)
    char lock_path[4096];
    snprintf(lock_path, sizeof lock_path, "%s/.lock", dir_path);
    if (lstat(lock_path, &st) == 0) {  // the lock file, if there: not a link, a regular file, not held
        int fd = open_lock_file(dir_path, lock_path);
        refuse_if_locked(fd, dir_path, lock_path);
        close(fd);  // and the lock with it: the claim takes it for good
    }
    refuse_other_runs_files(dir_path, resume_path, resumed_step);
}

void checkpoint_dir_claim(const char *dir_path, const char *resume_path, long long resumed_step) {
    char lock_path[4096];
    snprintf(lock_path, sizeof lock_path, "%s/.lock", dir_path);
    int fd = open_lock_file(dir_path, lock_path);
    refuse_if_locked(fd, dir_path, lock_path);
    char pid[32];
    int len = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)len, 0) != len)
        fatal_input("--checkpoint-dir %s: cannot write %s (%s)", dir_path, lock_path, strerror(errno));
    claimed_lock_fd = fd;
    refuse_other_runs_files(dir_path, resume_path, resumed_step);  // again: the directory may have changed since
}

const char *checkpoint_resolve(const char *path_or_dir, char *out, size_t out_len) {
    struct stat st;
    if (!*path_or_dir) fatal_input("--resume: empty path");
    if (stat(path_or_dir, &st) != 0) fatal_input("--resume %s: %s", path_or_dir, strerror(errno));
    if (!S_ISDIR(st.st_mode)) {
        snprintf(out, out_len, "%s", path_or_dir);
        return out;
    }
    checkpoint_clean_stale(path_or_dir);
    DIR *dir = opendir(path_or_dir);
    if (!dir) fatal_input("--resume %s: cannot read directory (%s)", path_or_dir, strerror(errno));
    long long best = -1;
    for (struct dirent *e; (e = readdir(dir));) {
        long long step = checkpoint_step_of_name(e->d_name);
        if (step > best) best = step;
    }
    closedir(dir);
    if (best < 0)
        fatal_input("--resume %s: no checkpoint in this directory (the trainer writes step_NNNNNN.safetensors)",
                    path_or_dir);
    checkpoint_path_for_step(path_or_dir, best, out, out_len);
    return out;
}
