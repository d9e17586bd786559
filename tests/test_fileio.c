// test_fileio.c: the atomic writer replaces only regular files. A rename onto /dev/null, a FIFO or a
// directory would destroy it (as root, /dev/null would become a regular file), so atomic_create
// refuses such a target, and atomic_commit refuses one that appeared while the file was written.
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fileio.h"
#include "test_util.h"

static char dir[] = "/tmp/test_fileio.XXXXXX";

// A fresh scratch directory per test (Check forks each), removed after it.
static void make_dir(void) { ck_assert_msg(mkdtemp(dir) != NULL, "mkdtemp failed"); }
static void remove_dir(void) {
    char command[128];
    snprintf(command, sizeof command, "rm -rf '%s'", dir);
    if (system(command) != 0) fprintf(stderr, "test_fileio: could not remove %s\n", dir);
}

static void path_in_dir(char *out, size_t len, const char *name) { snprintf(out, len, "%s/%s", dir, name); }

// No "<path>.tmp.<pid>" is left behind.
static void expect_no_temporary(const char *path) {
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    ck_assert_msg(access(tmp, F_OK) != 0, "%s was left behind", tmp);
}

START_TEST(test_regular_file_replaced) {
    char path[256], err[512];
    path_in_dir(path, sizeof path, "out.txt");
    AtomicFile f;
    ck_assert_msg(atomic_create(&f, path, err, sizeof err), "%s", err);
    fputs("new", f.fp);
    ck_assert_msg(atomic_commit(&f, err, sizeof err), "%s", err);
    size_t size;
    unsigned char *text = read_whole_file(path, &size, err, sizeof err);
    ck_assert_msg(text && size == 3 && memcmp(text, "new", 3) == 0, "read back %zu bytes", size);
    free(text);
}
END_TEST

START_TEST(test_fifo_refused_at_create) {
    char path[256], err[512] = "";
    path_in_dir(path, sizeof path, "fifo");
    ck_assert_int_eq(mkfifo(path, 0600), 0);
    AtomicFile f;
    ck_assert_msg(!atomic_create(&f, path, err, sizeof err), "a FIFO was accepted as a target");
    ck_assert_msg(strstr(err, "FIFO") != NULL, "message: %s", err);
    struct stat st;
    ck_assert_msg(stat(path, &st) == 0 && S_ISFIFO(st.st_mode), "the FIFO is gone");
    expect_no_temporary(path);
}
END_TEST

START_TEST(test_dev_null_refused_at_create) {
    char err[512] = "";
    AtomicFile f;
    ck_assert_msg(!atomic_create(&f, "/dev/null", err, sizeof err), "/dev/null was accepted as a target");
    ck_assert_msg(strstr(err, "device") != NULL, "message: %s", err);
    struct stat st;
    ck_assert_msg(stat("/dev/null", &st) == 0 && S_ISCHR(st.st_mode), "/dev/null is no longer a device");
}
END_TEST

// The target turns into a FIFO between create and commit: the commit must not rename over it.
START_TEST(test_fifo_refused_at_commit) {
    char path[256], err[512] = "";
    path_in_dir(path, sizeof path, "late_fifo");
    AtomicFile f;
    ck_assert_msg(atomic_create(&f, path, err, sizeof err), "%s", err);
    fputs("data", f.fp);
    ck_assert_int_eq(mkfifo(path, 0600), 0);
    ck_assert_msg(!atomic_commit(&f, err, sizeof err), "the commit renamed over a FIFO");
    struct stat st;
    ck_assert_msg(stat(path, &st) == 0 && S_ISFIFO(st.st_mode), "the FIFO was replaced");
    expect_no_temporary(path);
}
END_TEST

START_TEST(test_directory_refused) {
    char err[512] = "";
    AtomicFile f;
    ck_assert_msg(!atomic_create(&f, dir, err, sizeof err), "a directory was accepted as a target");
    ck_assert_msg(strstr(err, "directory") != NULL, "message: %s", err);
}
END_TEST

int main(void) {
    Suite *s = suite_create("fileio");
    TCase *tc = tcase_create("atomic writes replace only regular files");
    tcase_add_checked_fixture(tc, make_dir, remove_dir);
    tcase_add_test(tc, test_regular_file_replaced);
    tcase_add_test(tc, test_fifo_refused_at_create);
    tcase_add_test(tc, test_dev_null_refused_at_create);
    tcase_add_test(tc, test_fifo_refused_at_commit);
    tcase_add_test(tc, test_directory_refused);
    suite_add_tcase(s, tc);
    return run_suite(s);
}
