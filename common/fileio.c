#include "fileio.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"

// Why `path` may not be replaced by a rename: it exists and is not a regular file (a symbolic link
// is not: the rename would put a file in the link's place). NULL when it may.
static const char *not_replaceable(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return NULL;
    // A file without write permission is one its owner protected; a rename would replace it anyway.
    if (S_ISREG(st.st_mode)) return st.st_mode & 0222 ? NULL : "is read-only, which a rename would replace";
    if (S_ISLNK(st.st_mode)) return "is a symbolic link, which a rename would replace";
    if (S_ISDIR(st.st_mode)) return "is a directory";
    if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)) return "is a device, which a rename would replace";
    if (S_ISFIFO(st.st_mode)) return "is a FIFO, which a rename would replace";
    return "is not a regular file, which a rename would replace";
}

bool atomic_create(AtomicFile *f, const char *path, char *err, size_t err_len) {
    f->fp = NULL;
    int n = snprintf(f->path, sizeof f->path, "%s", path);
    int n_tmp = snprintf(f->tmp_path, sizeof f->tmp_path, "%s.tmp.%d", path, (int)getpid());
    if (n < 0 || n_tmp < 0 || (size_t)n_tmp >= sizeof f->tmp_path || (size_t)n >= sizeof f->path) {
        snprintf(err, err_len, "%.200s...: path too long", path);
        return false;
    }
    const char *why = not_replaceable(path);
    if (why) {
        snprintf(err, err_len, "%s: %s; refusing to write it", path, why);
        return false;
    }
    f->fp = fopen(f->tmp_path, "wb");
    if (!f->fp) {
        snprintf(err, err_len, "%s: cannot create (%s)", f->tmp_path, strerror(errno));
        return false;
    }
    return true;
}

bool atomic_commit(AtomicFile *f, char *err, size_t err_len) {
    bool ok = !ferror(f->fp) && fflush(f->fp) == 0 && fsync(fileno(f->fp)) == 0;
    int saved_errno = errno;
    if (fclose(f->fp) != 0 && ok) {
        ok = false;
        saved_errno = errno;
    }
    f->fp = NULL;
    const char *why = ok ? not_replaceable(f->path) : NULL;  // it may have appeared while we wrote
    if (why) {
        snprintf(err, err_len, "%s: %s; refusing to replace it", f->path, why);
        remove(f->tmp_path);
        return false;
    }
    if (ok && rename(f->tmp_path, f->path) != 0) {
        ok = false;
        saved_errno = errno;
    }
    if (!ok) {
        snprintf(err, err_len, "%s: write failed (%s); previous file left untouched", f->path, strerror(saved_errno));
        remove(f->tmp_path);
    }
    return ok;
}

void atomic_abort(AtomicFile *f) {
    if (f->fp) fclose(f->fp);
    f->fp = NULL;
    remove(f->tmp_path);
}

// ---- output checks -------------------------------------------------------------------------------

// Creates and removes "<path>.tmp.<pid>", the name atomic_create() will use. Returns errno, or 0.
static int probe_create(const char *path) {
    char probe[PATH_MAX + 32];
    snprintf(probe, sizeof probe, "%s.tmp.%d", path, (int)getpid());
    int fd = open(probe, O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0) return errno;
    close(fd);
    unlink(probe);
    return 0;
}

// Whether every name in path fits NAME_MAX, the last one with `suffix` more bytes (the temporary).
static bool names_fit(const char *path, size_t suffix) {
    for (const char *p = path; *p;) {
        size_t n = strcspn(p, "/");
        p += n;
        while (*p == '/') p++;
        if (n + (*p ? 0 : suffix) > NAME_MAX) return false;
    }
    return true;
}

static void strip_trailing_slashes(char *path) {
    for (size_t n = strlen(path); n > 1 && path[n - 1] == '/';) path[--n] = 0;
}

// The directory part of path ("." for a bare name, "/" for "/x").
static void parent_of(const char *path, char *out, size_t out_len) {
    snprintf(out, out_len, "%s", path);
    strip_trailing_slashes(out);  // "dir/" names dir
    char *slash = strrchr(out, '/');
    if (!slash) snprintf(out, out_len, ".");
    else if (slash == out) out[1] = 0;
    else *slash = 0;
}

static void check_parent(const char *flag, const char *path) {
    char parent[PATH_MAX];
    parent_of(path, parent, sizeof parent);
    struct stat st;
    if (stat(parent, &st) != 0)
        fatal_input("--%s %s: directory %s does not exist (%s)", flag, path, parent, strerror(errno));
    if (!S_ISDIR(st.st_mode)) fatal_input("--%s %s: %s is not a directory", flag, path, parent);
}

// A file in an existing directory: the name atomic_create() will write must be creatable.
static void check_file(const char *flag, const char *path) {
    const char *why = not_replaceable(path);
    if (why) fatal_input("--%s %s: %s; give a file name", flag, path, why);
    check_parent(flag, path);
    int error = probe_create(path);
    if (error) fatal_input("--%s %s: cannot create a file there (%s)", flag, path, strerror(error));
}

// An existing directory must take new files; a new one is not made here (its writer makes it, once
// the run's inputs have passed their checks: a refused run leaves nothing behind), but its parent
// must take new entries.
static void check_dir(const char *flag, const char *path) {
    struct stat st;
    if (stat(path, &st) != 0) {
        if (lstat(path, &st) == 0)  // a link to nothing: mkdir would fail on it after the training
            fatal_input("--%s %s: a symbolic link whose target does not exist; give a directory", flag, path);
        check_parent(flag, path);
        char name[PATH_MAX];  // "dir/" names dir: the probe goes next to it, not inside it
        snprintf(name, sizeof name, "%s", path);
        strip_trailing_slashes(name);
        int error = probe_create(name);  // "<path>.tmp.<pid>" in the parent: ranks probe apart
        if (error) fatal_input("--%s %s: cannot create the directory (%s)", flag, path, strerror(error));
        return;
    }
    if (!S_ISDIR(st.st_mode)) fatal_input("--%s %s: exists and is not a directory", flag, path);
    char probe[PATH_MAX];
    snprintf(probe, sizeof probe, "%s/probe", path);
    int error = probe_create(probe);
    if (error) fatal_input("--%s %s: cannot create files in this directory (%s)", flag, path, strerror(error));
}

void fileio_check_output_name(const char *flag, const char *path, OutputKind kind) {
    if (!*path) fatal_input("--%s: empty path", flag);
    // Room for the temporary's ".tmp.<pid>" suffix, within the name and within the path
    size_t suffix = (size_t)snprintf(NULL, 0, ".tmp.%d", (int)getpid());
    if (!names_fit(path, kind == OUTPUT_FILE ? suffix : 0))
        fatal_input("--%s %.60s...: a name is longer than NAME_MAX, %d bytes (a file's name needs %d more for its "
                    "temporary \".tmp.<pid>\")", flag, path, NAME_MAX, (int)suffix);
    if (strlen(path) + suffix + 16 >= PATH_MAX) fatal_input("--%s %.60s...: path too long", flag, path);
}

void fileio_check_output(const char *flag, const char *path, OutputKind kind) {
    if (!path) return;
    fileio_check_output_name(flag, path, kind);
    if (kind == OUTPUT_DIR) check_dir(flag, path);
    else check_file(flag, path);
}

void fileio_check_dir_entries(const char *flag, const char *dir, const char *prefix, const char *suffix) {
    DIR *d = dir ? opendir(dir) : NULL;
    if (!d) return;  // fileio_check_output reported what is wrong with the directory itself
    size_t np = strlen(prefix), ns = strlen(suffix);
    for (struct dirent *e; (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        if (n < np + ns || strncmp(e->d_name, prefix, np) != 0 || strcmp(e->d_name + n - ns, suffix) != 0) continue;
        char path[PATH_MAX + NAME_MAX + 2];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        const char *why = not_replaceable(path);
        if (why) {
            closedir(d);
            fatal_input("--%s %s: %s %s; the run would write it", flag, dir, path, why);
        }
    }
    closedir(d);
}

// path's directory resolved (realpath) and its last name: "dir/name" of an existing directory.
static bool resolved_name(const char *path, char *out, size_t out_len) {
    char parent[PATH_MAX], real[PATH_MAX];
    parent_of(path, parent, sizeof parent);
    if (!realpath(parent, real)) return false;
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    const char *name = path;
    for (size_t i = 0; i < n; i++)
        if (path[i] == '/') name = path + i + 1;
    return snprintf(out, out_len, "%s/%.*s", real, (int)(path + n - name), name) < (int)out_len;
}

bool fileio_same_file(const char *a, const char *b) {
    struct stat sa, sb;
    bool has_a = stat(a, &sa) == 0, has_b = stat(b, &sb) == 0;
    if (has_a && has_b) return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
    if (has_a || has_b) return false;
    char ra[PATH_MAX + NAME_MAX + 2], rb[PATH_MAX + NAME_MAX + 2];
    return resolved_name(a, ra, sizeof ra) && resolved_name(b, rb, sizeof rb) && strcmp(ra, rb) == 0;
}

FILE *fopen_regular(const char *path, char *err, size_t err_len) {
    // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, err_len, "%s: cannot open (%s)", path, strerror(errno));
        return NULL;
    }
    struct stat st = {0};
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(err, err_len, "%s: %s", path, S_ISDIR(st.st_mode) ? "is a directory" : "is not a regular file");
        close(fd);
        return NULL;
    }
    FILE *fp = fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) == 0 ? fdopen(fd, "rb") : NULL;
    if (!fp) {
        snprintf(err, err_len, "%s: cannot open (%s)", path, strerror(errno));
        close(fd);
    }
    return fp;
}

unsigned char *read_whole_file(const char *path, size_t *size, char *err, size_t err_len) {
    FILE *fp = fopen_regular(path, err, err_len);
    if (!fp) return NULL;
    unsigned char *data = NULL;
    long length = -1;
    if (fseek(fp, 0, SEEK_END) == 0) length = ftell(fp);
    if (length < 0 || fseek(fp, 0, SEEK_SET) != 0) {
        snprintf(err, err_len, "%s: cannot determine size (not a regular file?)", path);
        fclose(fp);
        return NULL;
    }
    data = malloc((size_t)length + 1);
    if (!data || fread(data, 1, (size_t)length, fp) != (size_t)length) {
        snprintf(err, err_len, "%s: read failed", path);
        free(data);
        fclose(fp);
        return NULL;
    }
    fclose(fp);
    data[length] = 0;
    *size = (size_t)length;
    return data;
}
