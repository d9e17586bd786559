#include "fileio.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

bool atomic_create(AtomicFile *f, const char *path, char *err, size_t err_len) {
    snprintf(f->path, sizeof f->path, "%s", path);
    snprintf(f->tmp_path, sizeof f->tmp_path, "%s.tmp.%d", path, (int)getpid());
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

unsigned char *read_whole_file(const char *path, size_t *size, char *err, size_t err_len) {
    FILE *fp = fopen(path, "rb");
    if (!fp) {
        snprintf(err, err_len, "%s: cannot open (%s)", path, strerror(errno));
        return NULL;
    }
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
